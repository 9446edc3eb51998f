"""specsplit server: target model, verification scheduler, gRPC service, model preparation."""
