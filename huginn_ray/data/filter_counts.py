"""The filter stage's counts: the lines it prints per source and the manifest's `document_filters`."""

from __future__ import annotations

from pathlib import Path


def print_counts(per_source: dict[str, dict], report: list[dict], guarded: list[dict], report_path: Path,
                 dedup: str) -> None:
    """The stage's console lines: per source what was kept and dropped, the common grams a report run kept, and
    where the decontamination report is."""
    for name, entry in per_source.items():
        decon = entry["decontaminated"]
        what = ", ".join(f"{n} {k}" for k, n in decon.items())
        near = entry.get("near_duplicates_dropped")
        print(f"[filter] {name}: {entry['documents_in']} documents -> {entry['rows']} kept; decontaminated: "
              f"{what or 'off'}; exact duplicates dropped: {entry['exact_duplicates_dropped']}"
              f"{' (dedup off)' if dedup == 'none' else ''}"
              f"{'' if near is None else f'; near duplicates dropped: {near}'}", flush=True)
    for c in guarded:  # mode report: listed and kept
        print(f"[filter] WARNING: {c['gram']!r} (evaluation item {c['item']}) is in {c['documents']} of the {c['of']} "
              f"documents of {c['source']}: common text, which mode drop refuses", flush=True)
    if report:
        print(f"[filter] {len(report)} documents share an n-gram with the evaluation sets: {report_path}",
              flush=True)


def filter_counts(marker: dict) -> dict[str, dict]:
    """The manifest's `document_filters`: per source `decontaminated` and `exact_duplicates_dropped` (and
    `near_duplicates_dropped` with dedup near)."""
    return {name: {key: entry[key] for key in ("decontaminated", "exact_duplicates_dropped",
                                               "near_duplicates_dropped") if key in entry}
            for name, entry in marker["sources"].items()}
