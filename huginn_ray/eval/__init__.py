"""Evaluation: depth scaling over the validation shards (depth_scaling.py) and lm-eval on the export (lm_eval.py)."""
