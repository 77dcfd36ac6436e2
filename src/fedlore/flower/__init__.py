"""Flower (flwr) integration: the only package of fedlore that imports flwr.

* :mod:`fedlore.flower.codec` — lossless Arrays / Broadcast / Reply / State <-> Flower records.
* :mod:`fedlore.flower.transport` — a :class:`~fedlore.engine.transport.Transport` over a Flower
  ``Grid`` (one message per sampled client, replies within a timeout).
* :mod:`fedlore.flower.app` — the ServerApp (runs fedlore's round loop) and the ClientApp (calls
  the same ``client_update``, client state in ``Context.state``).
* :mod:`fedlore.flower.sites` — the server's and each site's federation of a site-local
  deployment (``flower.site_data``); plain data code, no flwr.

Install with ``pip install -e '.[flower]'``.
"""

import os

# Offline and quiet: by default Flower sends telemetry, checks for updates and installs
# dependencies at run time; none of that may happen here.
for _key, _value in {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_key, _value)
