"""The Forgeboard API client and `forgeboard-ci`: Django-free, shipped alone as forgeboard-client (clients/python)."""
