"""Evaluation: depth scaling over the validation shards (depth_scaling.py), lm-eval on the export (lm_eval.py),
and the paper's GSM8k recipe with its depth sweep (gsm8k.py)."""
