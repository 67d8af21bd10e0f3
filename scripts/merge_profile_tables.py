"""Add the compute tables of one profile to another: e.g. compiled-layer tables measured today
(`megatrain profile --set compile_layers=true`) into the shipped measured profile, whose copy, optimizer and
overhead numbers stay as they are. Tables with the same key and seq are replaced by the donor's.

    PYTHONPATH=. python scripts/merge_profile_tables.py megatrain/profiles/h200-measured.json compiled.json out.json
"""
from __future__ import annotations

import argparse

from megatrain.sim import load_profile


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("donor")
    p.add_argument("out")
    p.add_argument("--only-compiled", action="store_true", help="take only the donor's compiled-layer tables")
    a = p.parse_args()
    base, donor = load_profile(a.base), load_profile(a.donor)
    taken = [t for t in donor.compute_tables if t.compiled or not a.only_compiled]
    replaced = {(t.key, t.seq) for t in taken}
    tables = [t for t in base.compute_tables if (t.key, t.seq) not in replaced] + taken
    notes = dict(base.notes)
    notes["compute_tables"] = (notes.get("compute_tables", "") + f" Plus {len(taken)} table(s) from "
                               f"{donor.name}: {donor.notes.get('compute_tables', '')}").strip()
    base.with_(compute_tables=tuple(tables), notes=notes).save(a.out)
    print(f"{a.out}: {len(tables)} compute tables ({len(taken)} from {a.donor})")


if __name__ == "__main__":
    main()
