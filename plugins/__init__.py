"""Built-in elasticfw plugins, installed as ``elasticfw_plugins`` and registered through the
``elasticfw`` entry-point group exactly like third-party plugins."""
