"""Evaluation at test-time depth (README.md): depth scaling over the validation shards (depth_scaling.py), lm-eval on
the export (lm_eval.py), and the paper's GSM8k recipe with its depth sweep (gsm8k.py), run as Ray Data batch
inference (batch_inference.py)."""
