"""`python -m costd.whatif < request.json`: answer one WhatIfRequest (proto JSON) locally.

Used by `llmmesh whatif --local`; reads the price book and curves as costd would
(--prices, --curves-dir or their LLMMESH_* environment variables) and prints the
WhatIfResponse as JSON. Bad questions exit 2 with the reason on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys

from google.protobuf import json_format

from costd import convert
from costd.config import CURVES_ENV, DEFAULT_CURVES_DIR, DEFAULT_PRICES, PRICES_ENV
from costd.pricebook import PriceBook
from costd.whatif.curve import load_curves
from costd.whatif.planner import WhatIfPlanner
from llmmesh.errors import InvalidArgument
from llmmesh.v1 import cost_pb2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m costd.whatif", description=__doc__)
    parser.add_argument("--prices", default=os.environ.get(PRICES_ENV, DEFAULT_PRICES))
    parser.add_argument("--curves-dir", default=os.environ.get(CURVES_ENV, DEFAULT_CURVES_DIR))
    args = parser.parse_args(argv)
    try:
        request = json_format.Parse(sys.stdin.read(), cost_pb2.WhatIfRequest())
        book = PriceBook.load(args.prices)
        planner = WhatIfPlanner(book, load_curves(args.curves_dir))
        profile = convert.profile_of(request.profile)
        scenario = convert.scenario_of(request.scenario)
        result = planner.answer(profile, scenario, request.curve_json)
    except (InvalidArgument, ValueError, json_format.ParseError) as error:
        print(f"whatif: {error}", file=sys.stderr)
        return 2
    print(json_format.MessageToJson(convert.whatif_response(result, book.currency)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
