"""Small models that ship with the package so pipelines run offline (tiny Llama, tiny DiT)."""
