"""KFP pipelines built from the stage components; ``compiled/`` holds their IR YAML (`kfrl compile`)."""
