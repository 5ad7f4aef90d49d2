"""Tools that run over data sets: batch runs (``explain.run``), labels, the HTML report, SpRAy strategies and
evaluation with metrics.

    batch.py          explain.run: a folder or DataLoader explained into OUT, resumable, sharded
    run_folder.py     OUT's lock and atomic writes
    index.py          OUT's index.csv: its rows written, read back and merged across shards
    run_record.py     run.json: what a run explained with, and why a resumed run is refused
    pipeline.py       decoding in worker processes, the background writer
    stored_maps.py    maps stored compactly and read back at the input's size
    labels.py         a data set's labels (folders, CSV, ImageFolder) and the targets they give
    html_report.py    explain.report: the static HTML page of a run (report_assets/)
    spray.py          explain.strategies: SpRAy clusters of maps
    evaluation.py     explain.evaluate: metrics of methods over a data set (detectors per instance too)
    concept_atlas.py  a layer's concept atlas: relevance maximisation over a folder, resumable, its static page
"""
