"""Bridges to model libraries. ``zlightning.integrations.huggingface`` turns a Hugging Face decoder-only causal LM
(Llama, GPT-2 families) into a ``zlightning.pipe.PipelineModule`` layer list and exports consolidated weights back to
a ``save_pretrained`` folder; it needs ``transformers`` (``pip install zlightning[hf]``), imported only there."""
