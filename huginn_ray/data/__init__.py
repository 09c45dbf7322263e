"""Data pipeline: sources -> download -> staging -> tokenizer -> tokenize/pack -> shuffled per-rank shards."""
