"""Names of the speculative methods (a light module: the CLI reads it before importing torch)."""

METHODS = ("auto", "none", "draft", "ngram", "suffix", "xtok", "lookahead", "early-exit", "eagle", "medusa", "hybrid")
TRAINED = ("eagle", "medusa", "draft")  # methods that can ship a trained drafter per target
FALLBACK = "ngram"  # what "auto" runs without a shipped drafter that pays: best untrained on Spec-Bench
TREE_ONLY = ("lookahead",)  # methods whose drafts come from a side branch of the tree forward
COMPOSED = ("hybrid",)  # methods built from a trained drafter; their cards hold only measurements
CONFIDENCE_METHODS = ("draft", "eagle", "medusa", "hybrid")  # chains that can stop at a token they are unsure of
