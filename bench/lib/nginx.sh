# The proxy floor for the gateway benchmarks (bench/gateway.sh, bench/gateway-replicas.sh):
# nginx (one worker process, keep-alive to the upstream, no access log) in front of a worker,
# measured beside the gateway in the same minute: what any reverse proxy adds on this host.
# Source it after bench/lib/wrk.sh (for WRK_DIR).
#   nginx_start ADDR   proxies 127.0.0.1:<free port> to ADDR (host:port); sets NGINX_URL,
#                      NGINX_PID (the master, stop it with kill) and NGINX_WORKER (whose CPU
#                      counts); files in $WRK_DIR/nginx. Status 1 with nginx's errors if it
#                      does not answer within 5 s (then it is stopped).
nginx_start() {
    local dir="$WRK_DIR/nginx" port
    port="$(python3 "$(dirname "${BASH_SOURCE[0]}")/../../tests/lib/free_port.py")"
    mkdir -p "$dir"
    cat >"$dir/nginx.conf" <<NGINX
worker_processes 1;
daemon off;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    client_body_temp_path $dir/body;
    proxy_temp_path $dir/proxy;
    upstream worker { server $1; keepalive 64; }
    server {
        listen 127.0.0.1:$port;
        location / { proxy_pass http://worker; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; }
    }
}
NGINX
    nginx -c "$dir/nginx.conf" -e "$dir/error.log" 2>"$dir/start.log" &
    NGINX_PID=$!
    NGINX_URL="http://127.0.0.1:$port"
    NGINX_WORKER=""
    local _
    for _ in $(seq 100); do
        NGINX_WORKER="$(pgrep -P "$NGINX_PID" 2>/dev/null | head -n 1)" || true
        [ -n "$NGINX_WORKER" ] && curl -s -o /dev/null "$NGINX_URL/health" && return 0
        sleep 0.05
    done
    kill "$NGINX_PID" 2>/dev/null || true
    echo "nginx did not start: $(cat "$dir/start.log" "$dir/error.log" 2>/dev/null)" >&2
    return 1
}
