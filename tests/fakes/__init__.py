"""Test doubles that tests install through production seams (constructor arguments, injected
objects), so that production code carries no fault switches; one module per thing faked."""
