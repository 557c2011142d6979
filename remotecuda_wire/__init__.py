"""What the client (``remotecuda``) and the gateway (``remotecuda_server``) share: the wire
protocol, the content-addressed upload cache, payload compression, the version and the
limits both sides enforce. It depends on torch and the serialisation libraries only, so the
gateway can be installed and read without the client's interception machinery."""
