"""Integrations with model libraries (imported on demand: ``from sparse_attn.integrations import
transformers``)."""
