"""The admin web: the HTTP API, the dashboard, admin accounts and tokens, the control port's
implementation over the running service, and fleet statistics."""
