# CoreDNS for the test node (scripts/images.sh builds it): the static binary scripts/control-plane.sh
# builds from the Go module proxy, on an empty image, as a numeric non-root user.
FROM scratch
COPY coredns /coredns
USER 65532:65532
ENTRYPOINT ["/coredns"]
