"""`pagefleet operator`: run the InferenceService operator (kopf), as `kopf run -m pagefleet.operator` would."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                        help="watch only this namespace (repeatable, globs allowed); default: all namespaces")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--peering", metavar="NAME", default=None,
                        help="coordinate several operator replicas through this KopfPeering object; "
                             "off by default (one replica, standalone)")
    parser.add_argument("--verbose", action="store_true", help="log each handler's progress")
    parser.add_argument("--debug", action="store_true", help="log kopf's internals too")


def run(args: argparse.Namespace) -> int:
    import kopf

    from pagefleet.operator import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose, debug=args.debug)
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
    )
    return 0
