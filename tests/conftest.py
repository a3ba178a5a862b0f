"""Session-wide test settings: keep plugin loading hermetic (only corekv's own entry points)."""
import os

os.environ.setdefault("COREKV_DISABLE_PLUGIN_AUTOLOAD", "1")
