"""The bus: topics, message schemas, the MQTT client boundary, ACL generation and broker configs."""
