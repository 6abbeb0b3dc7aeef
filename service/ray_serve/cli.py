"""``kda-serve-ray``: deploy kda-serve on a Ray cluster (Ray Serve), then return.

    kda-serve-ray --shards 8 --num-slots 256 --head-dim 128 --state-dir /mnt/kda --port 8000

Joins the cluster at ``--ray-address`` (default: the one this node belongs to, as after
``ray start``), starts Serve's HTTP proxy on ``--host``/``--port`` and deploys the
application; it keeps running on the cluster after this command exits
(``serve shutdown`` stops it). ``--wait`` keeps the command in the foreground.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import ray
from ray import serve

from ..http.request_id import RequestIdFilter
from ..logs import configure_logging
from .config import parse_scale_out
from .deploy import build_app


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    front = argparse.ArgumentParser(add_help=False)
    front.add_argument("--wait", action="store_true", help="stay in the foreground until interrupted")
    known, rest = front.parse_known_args(args)
    settings, scale_out = parse_scale_out(rest)
    configure_logging(settings.log_level, settings.log_format, filters=[RequestIdFilter()])
    ray.init(address=scale_out.ray_address)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build_app(settings, scale_out), name=scale_out.app_name, route_prefix="/", blocking=known.wait)
    print(f"kda-serve-ray: {scale_out.shards} shard(s) ({', '.join(scale_out.shard_names)}) serving on "
          f"http://{settings.host}:{settings.port}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
