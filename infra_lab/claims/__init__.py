"""Every published number and article claim the book cites, beside ours: the registry behind the
book's appendix (book/appendix_numbers.ipynb).

Each chapter registers what it cites in a module of its own (`claims.ch07` for chapter 07), as
`Entry` values: the claim in its own words, its source, the published figure, and a function
that computes our figure from the committed benchmark runs (benchmarks/results/) or from the
package's own arithmetic, with the machine and the date. A claim a chapter judges carries the
chapter's `verdict.Claim`, so the appendix's verdict is the chapter's. `claims.registry` gathers
them all; tests/test_claims_registry.py checks that every citation of a chapter has its entry.
"""
