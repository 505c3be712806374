#!/usr/bin/python3
"""Checks Chrome trace documents (the Trace Event Format's JSON object form)
against scripts/chrome-trace.schema.json with the jsonschema package
(Debian's python3-jsonschema), then against the rules a viewer needs that a
schema cannot say: each thread's B and E events nest (an E closes the
innermost open B, never before it began) and the complete (X) slices of one
track never overlap. Prints one line per document; exits 1 on the first
document that fails.

    /usr/bin/python3 scripts/check-chrome-trace.py TRACE.json...
"""
import json
import os
import sys

import jsonschema


def check(path, validator):
    with open(path) as f:
        doc = json.load(f)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.path)
        return f"{len(errors)} schema errors; first at {where}: {first.message}"
    events = doc["traceEvents"]
    stacks = {}
    slices = {}
    counts = {}
    for e in events:
        ph = e["ph"]
        counts[ph] = counts.get(ph, 0) + 1
        key = (e["pid"], e.get("tid"))
        if ph == "B":
            stacks.setdefault(key, []).append((e["name"], e["ts"]))
        elif ph == "E":
            stack = stacks.get(key, [])
            if not stack:
                return f"an E of {e['name']} on {key} closes nothing"
            name, ts = stack.pop()
            if name != e["name"] or e["ts"] < ts:
                return f"an E of {e['name']} on {key} closes {name}"
        elif ph == "X":
            slices.setdefault(key, []).append((e["ts"], e["ts"] + e["dur"]))
    open_calls = {k: v for k, v in stacks.items() if v}
    if open_calls:
        return f"calls left open: {open_calls}"
    for key, spans in slices.items():
        spans.sort()
        for a, b in zip(spans, spans[1:]):
            # Microseconds with three decimals: a nanosecond of rounding.
            if a[1] > b[0] + 0.001:
                return f"slices overlap on {key}: {a} and {b}"
    phases = ", ".join(f"{n} {p}" for p, n in sorted(counts.items()))
    return f"ok: {len(events)} events ({phases})"


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "chrome-trace.schema.json")) as f:
        schema = json.load(f)
    validator = jsonschema.Draft7Validator(schema)
    status = 0
    for path in sys.argv[1:]:
        verdict = check(path, validator)
        print(f"{path}: {verdict}")
        if not verdict.startswith("ok:"):
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
