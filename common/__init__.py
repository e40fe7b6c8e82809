"""What the repo's tools share and no one of them owns: atomic writes (`common.io`), the exactness oracle
(`common.exactness`) and command-line argument checks (`common.checks`). Like `bench`, `demo` and `training`, it runs
from the repo root and is not installed."""
