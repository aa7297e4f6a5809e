"""The coordinator's HTTP admin API (FastAPI), one router per resource under routes/."""
