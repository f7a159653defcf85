# The image of the Kubeflow training operator's worker init container (examples/k8s/pytorch-init-container.yaml
# runs `sh`, `seq` and `nslookup` in it) for the test node, where no registry serves the operator's default
# (alpine): Debian's static busybox and its applets, on an empty image, as user 65534. scripts/images.sh
# stages the binary in the build context.
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "--install", "-s", "/bin"]
USER 65534:65534
