"""Models users train, for the benchmarks: what matters here is their gradient tensors (shapes,
count and the order backward produces them), not their accuracy.

resnet50(): the ResNet-50 of He et al. (bottleneck blocks [3, 4, 6, 3], expansion 4, a 1x1
convolution and batch norm on each stage's first shortcut), with torchvision's parameter names,
shapes and registration order: 161 tensors, 25,557,032 parameters.
bert_encoder(): a BERT-base-sized torch.nn.TransformerEncoder (12 layers, width 768, 12 heads,
feed-forward 3072) under token and position embeddings and a 2-way head.
"""
import torch
from torch import nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    def __init__(self, classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.inplanes = 64
        self.layer1 = self._stage(64, 3, 1)
        self.layer2 = self._stage(128, 4, 2)
        self.layer3 = self._stage(256, 6, 2)
        self.layer4 = self._stage(512, 3, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * Bottleneck.expansion, classes)

    def _stage(self, planes, blocks, stride):
        out = planes * Bottleneck.expansion
        shortcut = nn.Sequential(nn.Conv2d(self.inplanes, out, 1, stride=stride, bias=False),
                                 nn.BatchNorm2d(out))
        layers = [Bottleneck(self.inplanes, planes, stride, shortcut)]
        self.inplanes = out
        layers += [Bottleneck(out, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class BertEncoder(nn.Module):
    def __init__(self, vocab=30522, width=768, layers=12, heads=12, ff=3072, positions=512,
                 classes=2):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(positions, width)
        self.norm = nn.LayerNorm(width)
        layer = nn.TransformerEncoderLayer(width, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, ids):
        where = torch.arange(ids.shape[1], device=ids.device)
        x = self.norm(self.tokens(ids) + self.positions(where))
        return self.head(self.encoder(x)[:, 0])


def resnet50() -> nn.Module:
    return ResNet50()


def bert_encoder() -> nn.Module:
    return BertEncoder()


MODELS = {"resnet50": resnet50, "transformer": bert_encoder}
