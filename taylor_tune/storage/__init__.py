"""Storage: where a sweep keeps its files, a local (or shared) folder or object storage (`s3://`, `gs://`, any URI
pyarrow opens), and the only code that tells the two apart.

- `location`: opening a location (`open_location`, the one opener), what a URI or a folder is called, and whether a
  storage can hold a sweep (`check_storage`).
- `folder`: a sweep's folder, read and guarded: its trials' records, outcomes and windows, the settings record, and
  the guards a resume passes on Tune's state (whose it is, whether its pickles are whole, whether its state parses).
- `lock`: one driver per sweep folder (a lock file, or a lease object in a bucket).
- `cache`: the shared entries built once across a sweep's processes and nodes (importance passes, requests).
- `names`: the files a sweep's folder holds by name (the settings record, the race's state, a trial's outcomes).

Every failure to open, list, read or write a location is a `StorageError`, one line naming the location and what
failed. Imports neither torch nor ray.
"""
