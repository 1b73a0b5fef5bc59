"""`python -m gateway [--host H] [--port P] [--redis-url URL] [--prefix P]`: the gateway alone.
Settings come from SPECD_* variables (gateway/settings.py); flags override them."""

from __future__ import annotations

import argparse
import sys

from gateway.settings import Settings, SettingsError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--prefix", default=None)
    args = p.parse_args(argv)
    try:
        settings = Settings.from_env(host=args.host, port=args.port, redis_url=args.redis_url,
                                     prefix=args.prefix)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from gateway.server import serve

    serve(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
