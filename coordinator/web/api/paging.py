"""Query parameters that page through lists and tails, bounded so the database never sees more."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query

# The largest id or offset PostgreSQL's bigint holds; past it a query fails (a 500, or a cut
# event stream), so such a value is refused at the boundary (422).
MAX_ROW_ID = 2**63 - 1

Skip = Annotated[int, Query(ge=0, le=MAX_ROW_ID, description="rows to skip")]
AfterId = Annotated[int | None, Query(ge=0, le=MAX_ROW_ID, description="the last id seen")]
