"""Moved to ``ctxrl.run.followers`` (issue 50); kept so that old imports and monkeypatch paths still work: this
module is that one (``sys.modules``), not a copy of its names."""

import sys

from ctxrl.run import followers as _moved

sys.modules[__name__] = _moved
