"""The transformers code written into an export (imports only torch and transformers; see export.py)."""
