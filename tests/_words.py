"""Words a reader of the book cannot know, and verdicts written by hand: read from the notebooks'
sources by tests/test_prose.py and from the built pages by tests/test_site.py."""
import re

# the book's own process, as a reader cannot know it; chart bars and random seeds are fine
INTERNAL = re.compile(r"\bseed article\b|\bseed's\b|\bthe seed\b(?! of)|\bissues?\b|\bthe bar\b[,:']|"
                      r"\ba bar of\b|\bbar of \d|\d+% bar\b|\bbook's bar\b|next GPU run", re.I)
# a verdict word outside infra_lab.verdict: a sentence that judges a claim by its own rule
VERDICT_WORDS = re.compile(r"\b(?:meets|misses|reaches|falls short of)\b[^.]{0,40}?\b(?:target|bar|claim|"
                           r"goal|aimed)|\bdoes not hold\b|\binconclusive\b|\bholds here\b", re.I)


# the same, as a whole string in code: `"meets" if x else "misses"`, later put in a sentence
QUOTED_VERDICT = re.compile(r"""(["'])(?:meets|misses|falls short of|does not hold|holds)\1""")
