"""Checkpoint conversion: Hugging Face transformers models to and from layout-free megaframe checkpoints."""
