"""Online side of spectune: load a policy table at server start and plan each step.

Imports only torch, triton, pyyaml and sibling runtime/kernels modules.
"""

from spectune.errors import SpectuneError, TableError
from spectune.runtime.table import SCHEMA, Table, read_table, write_table

__all__ = ["SCHEMA", "SpectuneError", "Table", "TableError", "read_table", "write_table"]
