"""Code generated from proto/pagedserve/v1/generation.proto by `make proto` (do not edit)."""
