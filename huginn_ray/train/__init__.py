"""Distributed training of the recurrent-depth model on Ray Train (see README.md in this directory)."""
