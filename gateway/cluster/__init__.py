"""Process supervision for local clusters: worker processes started, killed and restarted as new
incarnations (`lumen cluster up`). Apart from the gateway process's serving code, which never imports it."""
