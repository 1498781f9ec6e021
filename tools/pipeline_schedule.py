"""Draws the schedule that `equinox_shard.filter_pipeline` runs, from the table it runs
(`equinox_shard._manual.pipeline.schedule`), as Markdown tables for docs/pipeline.md.

    python tools/pipeline_schedule.py            # print the pictures
    python tools/pipeline_schedule.py --write    # rewrite them in docs/pipeline.md

Each picture sits in docs/pipeline.md between `<!-- schedule S M R -->` and
`<!-- /schedule -->`; tests/test_pipeline.py checks that they are what this prints now.
"""

import argparse
import pathlib
import re
import sys


_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT))

from equinox_shard._manual.pipeline import schedule  # noqa: E402


DOCS = _ROOT / "docs" / "pipeline.md"
_BLOCK = re.compile(
    r"(<!-- schedule (\d+) (\d+) (\d+) -->\n)(.*?)(<!-- /schedule -->)", re.DOTALL
)


def picture(stages: int, microbatches: int, repeats: int) -> str:
    """A Markdown table: one row per stage, one column per tick, forward ticks then
    the backward ticks (the same table, last tick first). `F3` is the forward pass of
    microbatch 3, `B3` its backward pass; with `repeats > 1`, `F3.1` is its second
    round through the stages; `·` is an idle stage."""
    table = schedule(stages, microbatches, repeats)
    ticks = table.shape[1]

    def cell(kind: str, micro: int, repeat: int) -> str:
        if micro < 0:
            return "·"
        return f"{kind}{micro}" + (f".{repeat}" if repeats > 1 else "")

    header = ["stage"] + [str(t) for t in range(2 * ticks)]
    rows = []
    for s in range(stages):
        forward = [cell("F", *table[s, t]) for t in range(ticks)]
        backward = [cell("B", *table[s, t]) for t in reversed(range(ticks))]
        rows.append([str(s)] + forward + backward)
    idle = int((table[..., 0] < 0).sum())
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        f"S = {stages} stages, M = {microbatches} microbatches, R = {repeats}: "
        f"{ticks} ticks each way; {idle} of {stages * ticks} stage-ticks idle "
        f"({idle / (stages * ticks):.3f}).",
    ]
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    """`text` (docs/pipeline.md) with every schedule block redrawn."""
    return _BLOCK.sub(
        lambda m: (
            m.group(1)
            + picture(int(m.group(2)), int(m.group(3)), int(m.group(4)))
            + m.group(6)
        ),
        text,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the docs page")
    args = parser.parse_args()
    text = DOCS.read_text()
    if args.write:
        DOCS.write_text(render(text))
    else:
        for m in _BLOCK.finditer(text):
            print(picture(int(m.group(2)), int(m.group(3)), int(m.group(4))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
