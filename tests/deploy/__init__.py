"""Deployment checks: the Helm chart, the images (see deploy/README.md)."""
