"""`python -m costd.whatif < request.json`: answer one WhatIfRequest (proto JSON) locally;
with --consolidation, one ConsolidationRequest.

Used by `llmmesh whatif --local` and `llmmesh whatif-consolidate --local`; reads the price
book and curves as costd would (--prices, --curves-dir or their LLMMESH_* environment
variables) and prints the response as JSON. Bad questions exit 2 with the reason on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys

from google.protobuf import json_format
from google.protobuf.message import Message

from costd import convert
from costd.config import CURVES_ENV, DEFAULT_CURVES_DIR, DEFAULT_PRICES, PRICES_ENV
from costd.pricebook import PriceBook
from costd.whatif.curve import load_curves
from costd.whatif.planner import WhatIfPlanner
from llmmesh.errors import InvalidArgument
from llmmesh.v1 import cost_pb2


def answer(planner: WhatIfPlanner, text: str) -> Message:
    request = json_format.Parse(text, cost_pb2.WhatIfRequest())
    result = planner.answer(convert.profile_of(request.profile),
                            convert.scenario_of(request.scenario), request.curve_json)
    return convert.whatif_response(result, planner.book.currency)


def answer_consolidation(planner: WhatIfPlanner, text: str) -> Message:
    request = json_format.Parse(text, cost_pb2.ConsolidationRequest())
    models = convert.consolidation_models(request.models, planner.curve_named)
    result = planner.consolidate(models, convert.scenario_of(request.scenario),
                                 request.device_memory_mib)
    return convert.consolidation_response(result, planner.book.currency)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m costd.whatif", description=__doc__)
    parser.add_argument("--prices", default=os.environ.get(PRICES_ENV, DEFAULT_PRICES))
    parser.add_argument("--curves-dir", default=os.environ.get(CURVES_ENV, DEFAULT_CURVES_DIR))
    parser.add_argument("--consolidation", action="store_true",
                        help="read a ConsolidationRequest instead of a WhatIfRequest")
    args = parser.parse_args(argv)
    try:
        planner = WhatIfPlanner(PriceBook.load(args.prices), load_curves(args.curves_dir))
        ask = answer_consolidation if args.consolidation else answer
        response = ask(planner, sys.stdin.read())
    except (InvalidArgument, ValueError, json_format.ParseError) as error:
        print(f"whatif: {error}", file=sys.stderr)
        return 2
    print(json_format.MessageToJson(response))
    return 0


if __name__ == "__main__":
    sys.exit(main())
