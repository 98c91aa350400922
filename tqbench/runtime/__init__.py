"""Running models: loading on mlx-lm's architectures with TurboQuant modules, tokenizers, generation."""
