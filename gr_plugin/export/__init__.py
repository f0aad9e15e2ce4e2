"""Export of the cached model: the graph side of the gr_kv ops (torch.export / AOTInductor)."""
