"""The sharding-specification language that every public function speaks.

Read `language` first (a specification and how it resolves against a PyTree), then
`leaves` (what a spec leaf may be, and `PathRules`), `kinds` (the table of spec-leaf
kinds) and `explain_rules` (what the rules of a specification do, as data).

Exports `language`, `leaves`, `kinds` and `explain_rules`, to the root and every wing.

Imports `_arrays`.
"""
