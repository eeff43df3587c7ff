"""Integrations with other training libraries: :mod:`.hf` (Hugging Face transformers.Trainer and
Accelerate)."""
