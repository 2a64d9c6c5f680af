from splitserve.engine.attention.backend import AttentionBackend, AttentionBatch, SeqSlice, get_backend

__all__ = ["AttentionBackend", "AttentionBatch", "SeqSlice", "get_backend"]
