"""epgen under other frameworks' models: ``epgen.integrations.transformers`` (Hugging Face
transformers v5 MoE models, expert-parallel through epgen's dispatch and combine)."""
