"""The operators' web console: pages, templates and hand-written assets, served by the API app."""
