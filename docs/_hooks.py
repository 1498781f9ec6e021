"""MkDocs hooks for the equinox_shard documentation.

- `index.md` is README.md and `changelog.md` is CHANGELOG.md, so that neither is kept
    twice. Links to repository files that are not documentation pages become plain code
    spans (MkDocs would otherwise fail the strict build on them).
- Every Markdown file under `docs/examples/` is added to the navigation.
- The build fails if a public name of `equinox_shard` has no `::: equinox_shard.name`
    entry on any page, so that a new export cannot go undocumented.
"""

import pathlib
import re

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File


_ROOT = pathlib.Path(__file__).resolve().parent.parent
_GENERATED = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
_DIRECTIVE = re.compile(r"^:::\s+equinox_shard\.(\w+)", re.MULTILINE)
_documented: set[str] = set()


def on_config(config):
    examples = sorted(
        p.relative_to(_ROOT / "docs").as_posix()
        for p in (_ROOT / "docs" / "examples").glob("*.md")
    )
    if examples:
        nav = config["nav"]
        at = next((i for i, x in enumerate(nav) if x == "changelog.md"), len(nav))
        nav.insert(at, {"Examples": examples})
    return config


def _rewrite_link(match, pages):
    text, target = match.group(1), match.group(2)
    if re.match(r"^[a-z]+:|^#", target):
        return match.group(0)
    path, _, anchor = target.partition("#")
    for page, source in _GENERATED.items():
        if path == source:
            return f"[{text}]({page}{'#' + anchor if anchor else ''})"
    if path.startswith("docs/") and path[len("docs/") :] in pages:
        return f"[{text}]({target[len('docs/') :]})"
    return text if text.startswith("`") else f"`{text}`"


def on_files(files, config):
    pages = {f.src_uri for f in files}
    for page, source in _GENERATED.items():
        text = (_ROOT / source).read_text()
        text = _LINK.sub(lambda m: _rewrite_link(m, pages), text)
        files.append(File.generated(config, page, content=text))
    return files


def on_page_markdown(markdown, page, config, files):
    _documented.update(_DIRECTIVE.findall(markdown))
    return markdown


def on_post_build(config):
    import equinox_shard

    public = {
        name
        for name, value in vars(equinox_shard).items()
        if not name.startswith("_") and not isinstance(value, type(equinox_shard))
    }
    missing = sorted(public - _documented)
    if missing:
        raise PluginError(
            "public names of equinox_shard with no `::: equinox_shard.<name>` entry "
            f"in the docs: {', '.join(missing)}"
        )
