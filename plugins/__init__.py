"""tlt plugins (importable as tlt_plugins): hook implementations injected into worker processes."""
