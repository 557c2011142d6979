"""The RemoteCUDA gateway: serves GPU (or CPU) sessions to RemoteCUDA clients over ZeroMQ."""
