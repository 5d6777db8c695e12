"""The serving cluster: controller, placement, autoscaler, gRPC gateway, configuration, CLI."""
