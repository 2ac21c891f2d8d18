"""The aiohttp SSE server: schema, routes, app."""
